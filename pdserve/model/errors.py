"""The one error type model loading raises."""


class ModelLoadError(Exception):
    """A model could not be loaded. The message names the file and the problem.

    Front ends print it as is, without a traceback.
    """
