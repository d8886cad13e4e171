"""A list of names stays one short line however many there are."""
from shared.short_list import short_list


def test_the_first_names_are_shown_and_the_rest_counted():
    assert short_list([]) == "none"
    assert short_list(["a", "b", "c"]) == "a, b, c"
    assert short_list(["a", "b", "c", "d", "e"]) == "a, b, c and 2 more"
    assert short_list([f"d{i}" for i in range(1000)], 5) == "d0, d1, d2, d3, d4 and 995 more"
