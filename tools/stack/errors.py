class StackError(Exception):
    """A refusal or failure the user can act on. The message names the thing at fault."""
