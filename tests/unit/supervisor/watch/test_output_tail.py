"""The worker's output as `status` and incidents show it: the text a terminal would leave on screen, never a
progress bar's carriage returns and escape sequences (`output_tail.visible_text`, and `OutputTail` reading a log)."""

from __future__ import annotations

import io

import pytest

from hangwatch.common.config.schema import DEFAULT_PROGRESS_PATTERN
from hangwatch.supervisor.watch.output_tail import OutputTail, visible_text

BAR = " train:  17%|█▋        | 10/60 [00:03<00:15,  3.21it/s]"


@pytest.mark.parametrize(
    "raw,shown",
    [
        ("step 3 loss 0.5", "step 3 loss 0.5"),
        ("  padded  ", "padded"),
        ("", ""),
        # tqdm: each redraw starts with \r; a nested bar moves the cursor back up with ESC[A
        (f"\r{BAR}\x1b[A", BAR.strip()),
        (f"\r train:   0%|          | 0/60 [00:00<?, ?it/s]\r{BAR}", BAR.strip()),
        (f"{BAR}\r", BAR.strip()),  # a trailing \r shows nothing new: the bar stays on screen
        ("\x1b[A", ""),
        ("\r", ""),
        ("\r   \r", ""),
        # colours and styles (CSI … m), cursor moves and line erasing (CSI K, CSI 2K), private modes (CSI ?25l)
        ("\x1b[32mok\x1b[0m done", "ok done"),
        ("\x1b[1;31mERROR\x1b[0m: disk full", "ERROR: disk full"),
        ("\x1b[2K\rEpoch 1: 100%", "Epoch 1: 100%"),
        ("\x1b[?25lhidden cursor\x1b[?25h", "hidden cursor"),
        ("loss\x1b[K 0.25", "loss 0.25"),
        # OSC: a window title (ended by BEL), a hyperlink (ended by ESC \)
        ("\x1b]0;training\x07step 7", "step 7"),
        ("see \x1b]8;;https://example.org\x1b\\the docs\x1b]8;;\x1b\\ now", "see the docs now"),
        # two-byte escapes, a sequence cut off by the end of the line, stray control characters
        ("\x1b(Bplain\x1b7", "plain"),
        ("step 9 \x1b[3", "step 9"),
        ("bell\x07 and\x08 nul\x00", "bell and nul"),
        ("tab\tkept", "tab\tkept"),
        ("a\nb", "b"),
        ("ünïcödé █▋ …", "ünïcödé █▋ …"),
    ],
)
def test_visible_text_is_what_a_terminal_leaves_on_screen(raw, shown):
    assert visible_text(raw) == shown


def test_a_progress_bars_output_is_recorded_as_its_last_visible_text(tmp_path):
    log = tmp_path / "worker.log"
    log.write_bytes(
        b"loading\n"
        + f"\r{BAR}\x1b[A".encode()
        + "\r train:  33%|███▎      | 20/60 [00:06<00:12,  3.30it/s]\x1b[A".encode()
        + b"\x1b[A\n"  # a nested bar's cursor move on a line of its own: nothing shows
    )
    tail = OutputTail(log, DEFAULT_PROGRESS_PATTERN)
    assert tail.read(1.0) == (True, True)
    expected = "train:  33%|███▎      | 20/60 [00:06<00:12,  3.30it/s]"
    assert tail.last_line == expected and tail.last_progress_line == expected
    evidence = tail.evidence(2.0)
    assert evidence["last_line"] == expected and evidence["last_progress_line"] == expected
    assert "\x1b" not in repr(evidence) and "\r" not in repr(evidence)


def test_real_tqdm_output_with_a_nested_bar_leaves_no_escape_codes(tmp_path):
    tqdm = pytest.importorskip("tqdm")
    out = io.StringIO()
    with tqdm.tqdm(total=3, desc="epoch", file=out, ascii=False, mininterval=0) as outer:
        for _ in range(3):
            with tqdm.tqdm(total=4, desc="batch", file=out, position=1, leave=False, mininterval=0) as inner:
                for _ in range(4):
                    inner.update()
            outer.update()
    raw = out.getvalue()
    assert "\x1b[A" in raw and "\r" in raw  # what the bars really wrote
    log = tmp_path / "worker.log"
    log.write_text(raw + "\n")
    tail = OutputTail(log, DEFAULT_PROGRESS_PATTERN)
    tail.read(1.0)
    assert tail.last_line.startswith("epoch: 100%") and "3/3" in tail.last_line, repr(tail.last_line)
    assert not any(c in tail.last_line + tail.last_progress_line for c in "\x1b\r\n")
