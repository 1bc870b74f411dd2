"""The simulator's user-facing error: bad catalogs names, config files and layouts."""


class SimConfigError(ValueError):
    """A simulator input is invalid; the message names the offending option or file."""
