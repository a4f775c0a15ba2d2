"""Assertions on errors shared by the workers (tests/workers/*.py)."""


def raises(fn, cls, *needles):
    """Runs fn, which must raise `cls` with every string of `needles` in its message; returns the message.

    Another exception (or none) fails the check with what happened instead.
    """
    try:
        fn()
    except cls as e:
        text = getattr(e, "message", str(e))
        for n in needles:
            assert n in text, f"{n!r} not in {text!r}"
        return text
    except Exception as e:  # the wrong class fails with what was raised
        raise AssertionError(f"wanted {cls.__name__}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"wanted {cls.__name__}, nothing was raised")
