"""Chaos campaigns on the CPU reference cluster: a seeded plan of faults injected under live
streaming traffic (``catalogue``), recovery driven as an orchestrator would
(``orchestrate``), invariants checked after every fault (``invariants``) against the
campaign's history (``history``), and the report (``report``). ``ftengine chaos`` runs one.
"""
