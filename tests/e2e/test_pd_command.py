"""``make pd-demo`` (``python demo/pd_pair.py``): a prefiller and a decoder of the tiny model
on an ``ExampleConnector`` pair, requests through the reference proxy, as docs/pd.md shows."""

from __future__ import annotations

import subprocess
import sys

import pytest

from demo.serve import REPO

pytestmark = pytest.mark.e2e


def test_the_pd_command_splices_every_request_and_shows_what_the_decoder_loaded(
    tmp_path, assert_stopped_in_order
):
    """Exit 0; the decoder loads the whole blocks of a 70-token prompt but its last token (64)
    and nothing of a 65-token one (the ExampleConnector's lookup misses it) nor of a 20-token
    one; every splice equals one instance; the pair stops in order and its shared KV
    directory is removed."""
    done = subprocess.run(
        [sys.executable, str(REPO / "demo" / "pd_pair.py"), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, start_new_session=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        name, _, rest = line.partition("  ")
        if name in ("70 tokens", "70, from row 0", "65 tokens", "20 tokens"):
            rows[name] = rest.split()
    # prompt, output, loaded, prefiller rows (span), decoder rows (span), spliced, same
    assert rows == {
        "70 tokens": ["70", "8", "64", "70", "(0-69)", "7", "(70-76)", "77", "yes"],
        "70, from row 0": ["70", "8", "64", "70", "(0-69)", "13", "(64-76)", "77", "yes"],
        "65 tokens": ["65", "8", "0", "65", "(0-64)", "7", "(65-71)", "72", "yes"],
        "20 tokens": ["20", "8", "0", "20", "(0-19)", "7", "(20-26)", "27", "yes"],
    }, done.stdout
    assert "every splice equals one instance" in done.stdout
    assert not list(tmp_path.glob("kv-shared-*"))
    for log in ("pd-prefill.log", "pd-decode.log"):
        assert_stopped_in_order((tmp_path / log).read_text(errors="replace"))
