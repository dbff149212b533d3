"""The one exception type for bad user input (files, configs, specs)."""


class InputError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits 2.

    The message names the file or option and the problem, e.g.
    "runs/a/ckpt.pt: truncated or not a torch.save file".
    """
