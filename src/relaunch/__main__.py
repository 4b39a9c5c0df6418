import gc

gc.disable()  # from the first import: the start-up runs without the collector (console_main)

from relaunch.cli import console_main  # noqa: E402

console_main()
