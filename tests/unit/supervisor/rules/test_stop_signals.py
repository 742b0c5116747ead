"""A stopping signal passed on as the bare command would have received it (`rules/stop_signals.py`): a table."""

from __future__ import annotations

import signal

import pytest

from hangwatch.supervisor.rules.stop_signals import passing, stops, words


@pytest.mark.parametrize(
    "sig, transparent, send, group, term_after",
    [
        (signal.SIGINT, True, signal.SIGINT, True, True),  # Ctrl-C: the whole group, as a terminal sends it
        (signal.SIGQUIT, True, signal.SIGQUIT, True, True),  # Ctrl-\
        (signal.SIGHUP, True, signal.SIGHUP, True, True),  # the terminal went away
        (signal.SIGTERM, True, signal.SIGTERM, False, False),  # `kill PID`: its main process
        (signal.SIGUSR1, True, signal.SIGTERM, False, False),  # hangwatch's own: stop to be requeued
        (None, True, signal.SIGTERM, False, False),  # `hangwatch stop`
        (signal.SIGINT, False, signal.SIGTERM, False, False),  # a service: SIGTERM to the worker, as always
        (signal.SIGQUIT, False, signal.SIGTERM, False, False),
    ],
)
def test_how_a_stop_reaches_the_command(sig, transparent, send, group, term_after):
    p = passing(sig, transparent)
    assert (p.send, p.group, p.term_after_grace) == (send, group, term_after)


@pytest.mark.parametrize(
    "sig, transparent, expected",
    [
        (signal.SIGHUP, True, True),
        (signal.SIGHUP, False, False),  # a service reopens its logs on SIGHUP
        (signal.SIGINT, False, True),
        (signal.SIGQUIT, True, True),
        (signal.SIGCHLD, True, False),
        (signal.SIGWINCH, True, False),
    ],
)
def test_which_signals_stop_the_run(sig, transparent, expected):
    assert stops(sig, transparent) is expected


@pytest.mark.parametrize(
    "sig, transparent, hangup_stops, expected",
    [
        (signal.SIGHUP, True, False, False),  # no terminal (files, pipes) or `nohup`: reopen the logs
        (signal.SIGHUP, True, True, True),
        (signal.SIGINT, True, False, True),
    ],
)
def test_a_hangup_stops_only_where_there_is_a_terminal(sig, transparent, hangup_stops, expected):
    assert stops(sig, transparent, hangup_stops) is expected


def test_the_words_a_person_reads():
    assert words(passing(signal.SIGINT, True), "SIGINT", True) == (
        "SIGINT: passed on to the command; again to end it at once"
    )
    assert words(passing(signal.SIGUSR1, True), None, True) == "SIGUSR1: passed on to the command as SIGTERM"
    assert words(passing(signal.SIGTERM, True), "SIGTERM from Slurm (scancel of job 12)", True) == (
        "SIGTERM from Slurm (scancel of job 12): passed on to the command"
    )
