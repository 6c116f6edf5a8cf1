"""User-facing errors of mindtrain-data (subclasses of mindtrain.config.UserError)."""

from mindtrain.config import ConfigError, UserError


class DataFileError(UserError):
    """A data file (.bin/.idx, json input, tokenizer) is missing, damaged or inconsistent."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


__all__ = ["ConfigError", "DataFileError", "UserError"]
