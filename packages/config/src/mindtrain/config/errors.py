"""The one exception type that every mindtrain package raises for a user's mistake."""


class UserError(Exception):
    """A mistake the user can fix (config, data files, command line).

    Entry points print ``str(err)`` as one line and exit with status 2. The message names
    the field or file and says what to do.
    """


class ConfigError(UserError):
    """A configuration value is missing, unknown, of the wrong type or inconsistent."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)
