"""The benefit in words: the one definition results files, the engine's unit datasets and
the figures state (no torch here, so analysis may use it too)."""


def benefit_description(reference: int, compared: int) -> str:
    """What `benefit` holds when the update at depth `reference` (the first update depth)
    is compared with the one at depth `compared`, and which way its sign points."""
    return (
        f"NLL after the update at depth {reference} minus NLL after the update at depth {compared}; "
        f"positive favours the depth-{compared} update"
    )
