"""Signed commit markers, and receivers that refuse unsigned, tampered, replayed or rolled-back steps."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from dcr_core.errors import IntegrityError, StateMismatchError, UntrustedError
from flows import run_receive
from flows.options import ReceiveOptions
from tests.support.helpers import assert_bits_equal, file_bytes
from tests.support.publishing import publish_steps

pytestmark = pytest.mark.faults(component="security", outcome="refused with a one-line error; the held state unchanged")


def _chain(n):
    g = torch.Generator().manual_seed(0)
    ck = {"w": torch.randn(40, 30, generator=g).bfloat16(), "nan": torch.tensor(float("nan")).bfloat16()}
    out = [ck]
    for s in range(1, n):
        ck = {k: v.clone() for k, v in ck.items()}
        ck["w"].view(-1).view(torch.int16)[s::7] ^= 1
        out.append(ck)
    return out


def _marker(root, step):
    return os.path.join(root, "steps", f"{step:012d}", "commit.json")


@pytest.fixture
def signed(tmp_path, monkeypatch):
    monkeypatch.setenv("DCR_SIGNING_KEY", "correct horse battery staple")
    root = str(tmp_path / "bucket")
    cks = _chain(3)
    publish_steps(root, cks, cache_dir=tmp_path / "c")
    return root, cks


def test_signed_steps_refit_exactly_and_carry_a_signature(signed, tmp_path):
    root, cks = signed
    state = tmp_path / "s.safetensors"
    run_receive(root, "r", str(state))
    assert_bits_equal(load_file(state), cks[2])
    assert json.load(open(_marker(root, 2)))["signature"]["algorithm"] == "hmac-sha256"


def test_a_receiver_with_the_key_refuses_unsigned_markers(tmp_path, monkeypatch):
    root = str(tmp_path / "bucket")
    publish_steps(root, _chain(2), cache_dir=tmp_path / "c")  # no key: unsigned
    monkeypatch.setenv("DCR_SIGNING_KEY", "k")
    with pytest.raises(IntegrityError, match="not signed"):
        run_receive(root, "r", str(tmp_path / "s.safetensors"))
    assert not (tmp_path / "s.safetensors").exists()


@pytest.mark.parametrize("field", ["summary", "policy", "key"])
def test_tampered_markers_or_another_key_are_refused_and_nothing_changes(signed, tmp_path, monkeypatch, field):
    root, cks = signed
    state = tmp_path / "s.safetensors"
    run_receive(root, "r", str(state), 1)
    before = file_bytes(state)
    path = _marker(root, 2)
    d = json.load(open(path))
    if field == "summary":
        d["summary"]["bytes_stored"] = 1
    elif field == "policy":
        d["policy_digest"] = "0" * 64
    json.dump(d, open(path, "w"))
    if field == "key":
        monkeypatch.setenv("DCR_SIGNING_KEY", "another key")
    with pytest.raises(IntegrityError) as ei:
        run_receive(root, "r", str(state), 2)
    assert len(str(ei.value).splitlines()) == 1
    assert file_bytes(state) == before


def test_a_signed_marker_replayed_under_another_step_is_refused(signed, tmp_path):
    root, _ = signed
    step3 = os.path.join(root, "steps", f"{3:012d}")
    shutil.copytree(os.path.join(root, "steps", f"{1:012d}"), step3)
    d = json.load(open(os.path.join(step3, "commit.json")))
    d["step"] = 3  # the signature covers the step
    json.dump(d, open(os.path.join(step3, "commit.json"), "w"))
    with pytest.raises(IntegrityError, match="signature"):
        run_receive(root, "r", str(tmp_path / "s.safetensors"), 3)


def test_a_rolled_back_root_is_refused_and_the_held_state_is_kept(signed, tmp_path):
    root, cks = signed
    state = tmp_path / "s.safetensors"
    run_receive(root, "r", str(state))
    before = file_bytes(state)
    os.unlink(_marker(root, 2))  # the newest step vanished: "latest" would now be older than what is held
    for step in (None, 1):
        with pytest.raises(StateMismatchError, match="not committed"):
            run_receive(root, "r", str(state), step)
    assert file_bytes(state) == before


# -- Ed25519: publishers hold the private key, receivers only the public one -----------------------


@pytest.fixture
def ed25519(tmp_path, monkeypatch):
    from storage import signing

    signing.keygen(tmp_path / "key")
    monkeypatch.setenv("DCR_SIGNING_KEY_FILE", str(tmp_path / "key"))
    root = str(tmp_path / "bucket")
    cks = _chain(3)
    publish_steps(root, cks, cache_dir=tmp_path / "c")
    monkeypatch.delenv("DCR_SIGNING_KEY_FILE")
    monkeypatch.setenv("DCR_VERIFY_KEY_FILE", str(tmp_path / "key.pub"))  # from here on: a receiver
    return root, cks


def test_ed25519_signed_steps_refit_exactly_with_only_the_public_key(ed25519, tmp_path):
    root, cks = ed25519
    state = tmp_path / "s.safetensors"
    run_receive(root, "r", str(state))
    assert_bits_equal(load_file(state), cks[2])
    sig = json.load(open(_marker(root, 2)))["signature"]
    assert sig["algorithm"] == "ed25519" and len(bytes.fromhex(sig["value"])) == 64


@pytest.mark.parametrize("how", ["edited", "unsigned", "hmac", "another-pair", "replayed"])
def test_a_receiver_with_the_public_key_refuses_what_the_private_key_did_not_sign(ed25519, tmp_path, how):
    from storage import signing

    root, cks = ed25519
    state = tmp_path / "s.safetensors"
    run_receive(root, "r", str(state), 1)
    before = file_bytes(state)
    path = _marker(root, 2)
    d = json.load(open(path))
    body = {k: v for k, v in d.items() if k != "signature"}
    if how == "edited":
        d["summary"]["bytes_stored"] = 1
    elif how == "unsigned":
        del d["signature"]
    elif how == "hmac":  # someone with an HMAC secret (or none) cannot stand in for the key pair
        d["signature"] = {"algorithm": "hmac-sha256", "value": signing.Key("hmac-sha256", "x", secret=b"s").sign(body)}
    elif how == "another-pair":
        other = signing.keygen(tmp_path / "other")
        d["signature"] = {"algorithm": "ed25519", "value": other.sign(body)}
    elif how == "replayed":  # step 1's marker, signed, under step 2
        d = json.load(open(_marker(root, 1)))
        d["step"] = 2
    json.dump(d, open(path, "w"))
    with pytest.raises(IntegrityError) as ei:
        run_receive(root, "r", str(state), 2)
    assert len(str(ei.value).splitlines()) == 1 and "commit.json" in str(ei.value)
    assert file_bytes(state) == before


def test_keys_of_the_wrong_kind_are_refused_by_name(tmp_path, monkeypatch):
    from dcr_core.errors import UsageError
    from storage import signing

    signing.keygen(tmp_path / "a")
    signing.keygen(tmp_path / "b")
    cases = [  # environment -> (function, what the one-line error says)
        ({"DCR_SIGNING_KEY_FILE": "a.pub"}, signing.signing_key, "holds a public key"),
        ({"DCR_VERIFY_KEY_FILE": "a"}, signing.verify_key, "holds a private key"),
        ({"DCR_VERIFY_KEY_FILE": "secret"}, signing.verify_key, "not an Ed25519 public key"),
        ({"DCR_VERIFY_KEY_FILE": "a.pub", "DCR_SIGNING_KEY_FILE": "b"}, signing.verify_key, "not one key pair"),
        ({"DCR_VERIFY_KEY_FILE": "a.pub"}, signing.publisher_key, "no signing key"),
        ({"DCR_VERIFY_KEY_FILE": "missing"}, signing.verify_key, "cannot read the verify key"),
    ]
    (tmp_path / "secret").write_text("an hmac secret\n")
    for env, fn, message in cases:
        with monkeypatch.context() as m:
            for var in ("DCR_SIGNING_KEY", "DCR_SIGNING_KEY_FILE", "DCR_VERIFY_KEY_FILE"):
                m.delenv(var, raising=False)
            for var, name in env.items():
                m.setenv(var, str(tmp_path / name))
            with pytest.raises(UsageError, match=message):
                fn()
    with monkeypatch.context() as m:  # a matching pair on one machine is fine: verify with the public key
        m.setenv("DCR_SIGNING_KEY_FILE", str(tmp_path / "a"))
        m.setenv("DCR_VERIFY_KEY_FILE", str(tmp_path / "a.pub"))
        assert signing.verify_key().fingerprint == signing.signing_key().fingerprint


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(tmp_path):
    from tests.support.cli import dcr

    out = dcr("keygen", tmp_path / "k", check=0)
    assert "ed25519:" in out.stdout
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "k").read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert (tmp_path / "k.pub").read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    before = (tmp_path / "k").read_bytes()
    out = dcr("keygen", tmp_path / "k", check=2)
    assert "never overwrites" in out.stderr and (tmp_path / "k").read_bytes() == before


# -- a reader without a key, and readers that must have one ----------------------------------------


def test_a_signed_root_says_so_and_a_reader_without_a_key_warns_once_or_refuses(ed25519, tmp_path, monkeypatch):
    """``run.json`` of a ROOT whose first publisher signed says so. A receiver with no key reads it
    with one warning line naming what to set; under ``--require-signed`` (or DCR_REQUIRE_SIGNED=1) it
    refuses in one line and nothing changes. With the key, ``--require-signed`` reads as usual."""
    from tests.support.cli import dcr

    root, cks = ed25519
    assert json.load(open(os.path.join(root, "run.json")))["signed"] == "ed25519"
    monkeypatch.delenv("DCR_VERIFY_KEY_FILE")
    state = tmp_path / "s.safetensors"
    out = dcr("receive", root, "--receiver", "r", "--state", state, "--step", 1, check=0)
    warning = out.stderr.strip().splitlines()
    assert len(warning) == 1 and "signatures are not checked" in warning[0] and "DCR_VERIFY_KEY_FILE" in warning[0], out.stderr
    before = file_bytes(state)
    for args, env, said in ((("--require-signed",), {}, "receiver r: --require-signed is set"),
                            ((), {"DCR_REQUIRE_SIGNED": "1"}, "DCR_REQUIRE_SIGNED is set")):
        out = dcr("receive", root, "--receiver", "r", "--state", state, *args, env=env, check=5)
        assert len(out.stderr.strip().splitlines()) == 1 and said in out.stderr, out.stderr
        assert "no key to verify with: set DCR_VERIFY_KEY_FILE" in out.stderr
        assert file_bytes(state) == before
    # the option is the receive's own, not the process's: nothing else of it changes
    with pytest.raises(UntrustedError, match="--require-signed is set"):
        run_receive(root, "r", str(state), options=ReceiveOptions(require_signed=True))
    assert "DCR_REQUIRE_SIGNED" not in os.environ and file_bytes(state) == before
    dcr("receive", root, "--receiver", "r", "--state", state, "--require-signed",
        env={"DCR_VERIFY_KEY_FILE": str(tmp_path / "key.pub")}, check=0)
    assert_bits_equal(load_file(state), cks[2])
    out = dcr("receive", root, "--receiver", "r", "--state", state, env={"DCR_REQUIRE_SIGNED": "maybe"}, check=2)
    assert "DCR_REQUIRE_SIGNED='maybe' must be 1 or 0" in out.stderr


def test_an_unsigned_root_refused_by_a_verify_key_names_that_variable(tmp_path, monkeypatch):
    """Only DCR_VERIFY_KEY_FILE is set and the ROOT is unsigned: the refusal names that variable, not
    "a signing key" the reader never set."""
    from storage import signing

    root = str(tmp_path / "bucket")
    publish_steps(root, _chain(2), cache_dir=tmp_path / "c")
    assert "signed" not in json.load(open(os.path.join(root, "run.json")))
    signing.keygen(tmp_path / "key")
    monkeypatch.setenv("DCR_VERIFY_KEY_FILE", str(tmp_path / "key.pub"))
    with pytest.raises(IntegrityError, match=f"commit marker is not signed, and DCR_VERIFY_KEY_FILE={tmp_path / 'key.pub'} "
                                             "says markers must be signed"):
        run_receive(root, "r", str(tmp_path / "s.safetensors"))
    assert not (tmp_path / "s.safetensors").exists()
