"""Reading the JSON files of a model folder with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.model.errors import ModelLoadError


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; `ModelLoadError` naming the file if unreadable or not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data
