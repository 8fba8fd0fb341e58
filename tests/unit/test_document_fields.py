"""The column checks a manifest is parsed with: the fast path (a whole column in C) must accept exactly
what the item-by-item parsers accept, and a column it refuses must still fail, naming the bad item."""

import pytest

from dcr_core.errors import IntegrityError
from storage.document_fields import MAX_DIM, all_digests, all_ints, parse_shape
from storage.manifest import ChunkTable

D = "0123456789abcdef" * 4


@pytest.mark.parametrize("column, ok", [
    ([], True), ([0, 1, 5], True), ([7], True),
    ([True], False), ([0, False], False),  # bools are ints to isinstance, not to a manifest
    ([1.0], False), ([-1], False), ([1 << 62 + 1], False), (["1"], False), ([None], False),
])
def test_all_ints(column, ok):
    assert all_ints(column) is ok


@pytest.mark.parametrize("column, ok", [
    ([], True), ([D], True), ([D, D[::-1]], True),
    ([D.upper()], False), ([D[:-1]], False), ([D + "0"], False), ([D[:-1] + "\n"], False), ([D[:-1] + "g"], False),
    ([D[:30] + " " + D[31:]], False), ([1], False), ([D, None], False),
])
def test_all_digests(column, ok):
    assert all_digests(column) is ok


def test_parse_shape_takes_a_well_formed_shape_whole_and_names_a_bad_dimension():
    assert parse_shape([2, 3], "w") == (2, 3) and parse_shape([], "w") == ()
    for bad in ([2, True], [2, -1], [MAX_DIM + 1], [2.0], "23", [[2]]):
        with pytest.raises(IntegrityError, match="^w: "):
            parse_shape(bad, "w")


def test_a_chunk_table_refuses_what_its_columns_do_not_hold():
    good = {"indices": [0, 2], "digests": [D, D], "nbytes": [4, 4]}
    assert ChunkTable.from_dict(good, "t", 3).indices == (0, 2)
    for key, bad, why in [("indices", [2, 0], "strictly increasing"), ("indices", [0, 0], "strictly increasing"),
                          ("indices", [0, 3], "expected an integer in 0..2"), ("indices", [0, True], "expected an integer"),
                          ("digests", [D, D.upper()], "64-hex-digit digest"), ("nbytes", [4, -1], "expected an integer")]:
        with pytest.raises(IntegrityError, match=why):
            ChunkTable.from_dict({**good, key: bad}, "t", 3)
