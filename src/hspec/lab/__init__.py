"""The lab: research tooling over the library's evaluations, on a floor of its own above it.

A long comparison is evaluated shard by shard (`merge`), the H-Spec paper's claims are tested on the
merged files (`claims`, and `findings` on the records of one evaluation), and every drafter is put on
one row across them (`table`). The library never imports this package (tests/test_layering.py); the
command line reaches it through `hspec lab ...` and hands `findings` to `hspec eval`'s summary.
"""
