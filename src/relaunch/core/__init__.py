"""Pure decisions: no I/O, no clock, no processes.

Everything in this package takes its inputs (including ``now``) as arguments and returns data, so it
can be tested table-driven and reasoned about without a running system. A test enforces that no
module here imports os, subprocess, socket, threading or time.
"""
