"""A soak of mixed clients against a live loopback server: whole and streamed completions (some with stop
strings), slow readers, clients that cancel a stream or leave before the answer, hostile requests and
chats, all at once. Every good request's text must equal its answer alone, nothing may 5xx, and the
process's file descriptors must come back and its RSS stay flat within a stated bound.

HSPEC_SOAK_SECONDS sets the length (default 4 s here; `python scripts/server_hardening.py` soaks for
ten minutes and reports the figures).
"""

from __future__ import annotations

import os

from conftest import load_script, load_tiny
from hspec.serving.limits import LOOPBACK_NAMES, ServingLimits

hardening = load_script("hardening_server")
soak = load_script("hardening_soak")

RSS_BOUND_MIB = 64  # allocator noise over a few seconds is a few MiB; a leak per request would pass this fast


def test_mixed_clients_get_their_answers_alone_and_leave_nothing_behind(tiny_dirs):
    target = load_tiny(tiny_dirs["llama"])
    target.tokenizer = hardening.ByteChatTokenizer(target.config.vocab_size)
    seconds = float(os.environ.get("HSPEC_SOAK_SECONDS", "4"))
    limits = ServingLimits(api_key=hardening.API_KEY, allowed_hosts=LOOPBACK_NAMES)
    with hardening.start_server(target, limits) as srv:
        report = soak.soak(srv.url, seconds, clients=4, api_key=hardening.API_KEY)
    assert not report.unexpected, report.unexpected[:5]
    assert report.mismatches == 0
    assert set(report.by_kind) == set(soak.CLIENT_KINDS)  # every kind of client ran
    assert report.served >= 10 and report.left >= 2 and report.refused >= 2
    assert report.fds_after <= report.fds_before, (report.fds_before, report.fds_after)
    assert report.rss_after_mib - report.rss_before_mib < RSS_BOUND_MIB
