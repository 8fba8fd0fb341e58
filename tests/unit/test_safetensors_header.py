"""A safetensors header is checked column by column when it is well formed (``_entries_whole``), entry
by entry otherwise: both must agree on every header, and a malformed one still fails naming its tensor."""

import json
import struct

import pytest

from dcr_core.errors import InvalidCheckpointError
from storage.local import safetensors as st


def _raw(entries: dict, metadata: dict | None = None) -> bytes:
    doc = ({"__metadata__": metadata} if metadata is not None else {}) | entries
    text = json.dumps(doc).encode()
    return struct.pack("<Q", len(text)) + text


def _both(raw: bytes, monkeypatch):
    st.header_entries.cache_clear()
    fast = st.header_entries(raw)
    st.header_entries.cache_clear()
    with monkeypatch.context() as m:
        m.setattr(st, "_entries_whole", lambda header: None)
        slow = st.header_entries(raw)
    st.header_entries.cache_clear()
    return fast, slow


def test_well_formed_headers_read_the_same_either_way(monkeypatch):
    entries = {  # out of file order, 0-d, empty, every width of dtype
        "z": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [100, 124]},
        "a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
        "e": {"dtype": "I64", "shape": [0, 5], "data_offsets": [4, 4]},
        "b": {"dtype": "U8", "shape": [7], "data_offsets": [4, 11]},
        "c": {"dtype": "F64", "shape": [2, 1, 1], "data_offsets": [11, 27]},
        "d": {"dtype": "BOOL", "shape": [73], "data_offsets": [27, 100]},
    }
    fast, slow = _both(_raw(entries, {"k": "v"}), monkeypatch)
    assert fast == slow and fast[0]["a"].shape == () and fast[2]["z"] == 100 and fast[3] == 124
    assert list(fast[0]) == list(entries) and fast[1] == {"k": "v"}
    assert _both(_raw({}), monkeypatch)[0] == ({}, {}, {}, 0)


@pytest.mark.parametrize("bad, why", [
    ({"dtype": "BF17", "shape": [2], "data_offsets": [0, 4]}, "unsupported dtype"),
    ({"dtype": ["BF16"], "shape": [2], "data_offsets": [4, 8]}, "unsupported dtype"),
    ({"dtype": "BF16", "shape": [2], "data_offsets": [0, 5]}, "inconsistent shape/offsets"),
    ({"dtype": "BF16", "shape": [-2], "data_offsets": [4, 0]}, "inconsistent shape/offsets"),
    ({"dtype": "BF16", "shape": [2**40, 2**40], "data_offsets": [0, 4]}, "inconsistent shape/offsets"),
    ({"dtype": "BF16", "shape": [2], "data_offsets": [0]}, "malformed"),
    ({"dtype": "BF16", "shape": [2, "x"], "data_offsets": [4, 8]}, "malformed"),
    ({"dtype": "BF16", "data_offsets": [0, 4]}, "malformed"),
    ({"dtype": "BF16", "shape": [2], "data_offsets": [2, 6]}, "overlap"),
])
def test_a_malformed_entry_fails_naming_its_tensor(bad, why):
    good = {"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}
    st.header_entries.cache_clear()
    with pytest.raises(InvalidCheckpointError, match=why) as e:
        st.header_entries(_raw(good | {"x": bad}))
    assert "'x'" in str(e.value) or "'a'" in str(e.value)
