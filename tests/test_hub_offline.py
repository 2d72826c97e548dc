"""--tokenizer hf:NAME without a network: one line at once, not the Hub client's retries."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from conftest import REPO, assert_one_line_error


def closed_port() -> int:
    """A local port nothing listens on: a connection there is refused at once, as offline."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hf_tokenizer_offline_fails_fast_in_one_line(tmp_path):
    """The Hub at a closed port and an empty cache: before, 5 retries over 24-28 s, one printed per try."""
    text = tmp_path / "a.txt"
    text.write_text("hello\n")
    env = {
        **os.environ,
        "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",
    }
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "fastpt.prepare", str(text), "--out", str(tmp_path / "out"), "--tokenizer", "hf:gpt2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    took = time.monotonic() - start
    assert_one_line_error(done.returncode, done.stderr, "--tokenizer hf:gpt2: cannot fetch it from the Hugging Face")
    assert "Retry" not in done.stderr and took < 15, (took, done.stderr)
    assert not (tmp_path / "out").exists()
