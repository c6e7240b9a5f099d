"""The one base of every mistake a user can fix, in whichever layer finds it."""


class UserError(Exception):
    """A mistake the user can fix (a config field, a task file, a key file, a port in
    use, a mesh that refused this node...): its `str()` is one line fit to print, and
    `meshfl` prints it and exits with status 2 instead of a traceback. Every layer's
    errors of that kind derive from it, so a command, a node host and the Python API
    tell them from bugs by this class alone."""
