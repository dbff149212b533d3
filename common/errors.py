"""The one exception type for bad user input (files, configs, specs)."""


class InputError(ValueError):
    """Bad input from the user, raised where the input is checked: the CLI prints the
    message on one line and exits 2. Any other exception is a bug and keeps its traceback.

    The message names the file or option and the problem, e.g.
    "runs/a/ckpt.pt: truncated or not a torch.save file". A ValueError subclass, so code
    that validated through the Python API with `except ValueError` keeps working.
    """
