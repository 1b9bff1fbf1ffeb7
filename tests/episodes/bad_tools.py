"""Tools that must be refused at load time, one fault each."""


def no_hint(a: int, b) -> int:
    """Add.

    Args:
        a: first.
        b: second.
    """
    return a + b


def no_doc(a: int) -> int:
    return a


def undocumented_arg(a: int, b: int) -> int:
    """Add.

    Args:
        a: first.
    """
    return a + b


def star_args(*values: int) -> int:
    """Sum.

    Args:
        values: numbers.
    """
    return sum(values)


class NotAFunction:
    """A class."""


CONSTANT = 3


def typed(count: int, ratio: float, name: str, flag: bool, items: list[int], note: str = "x",
          opt: float = 0.5) -> str:
    """Exercise every plain type.

    Args:
        count: an integer.
        ratio: a float.
        name: a string.
        flag: a boolean.
        items: a list of integers.
        note: has a default.
        opt: has a default too.
    """
    return f"{count} {ratio} {name} {flag} {items} {note} {opt}"
