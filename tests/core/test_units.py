import pytest

from shardscope.units import GB, GIB, UnitError, format_bytes, parse_bytes, parse_count


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7.5B", 7_500_000_000),
        ("70e9", 70_000_000_000),
        ("6738415616", 6_738_415_616),
        ("125M", 125_000_000),
        ("1.5t", 1_500_000_000_000),
        ("3k", 3000),
    ],
)
def test_parse_count(text: str, expected: int) -> None:
    assert parse_count(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "7.5X", "1.5", "-3", "nan"])
def test_parse_count_rejects(text: str) -> None:
    with pytest.raises(UnitError):
        parse_count(text)


def test_parse_bytes_distinguishes_gib_and_gb() -> None:
    assert parse_bytes("80GiB") == 80 * GIB
    assert parse_bytes("80GB") == 80 * GB
    assert parse_bytes("512MiB") == 512 * 1024**2
    assert parse_bytes("4096") == 4096
    with pytest.raises(UnitError):
        parse_bytes("80 parsecs")


def test_format_bytes_names_the_unit() -> None:
    assert format_bytes(GIB) == "1.00 GiB"
    assert format_bytes(GB, "GB") == "1.00 GB"
    assert format_bytes(GIB, "GB") == "1.07 GB"
    with pytest.raises(UnitError):
        format_bytes(1, "furlongs")
