"""Write ``<pid>.pid`` into the directory ``sys.argv[1]``, print ``ready``, sleep for ever
(SIGTERM -> exit, and the idle launcher)."""

import os
import sys
import time

with open(os.path.join(sys.argv[1], f"{os.getpid()}.pid"), "w") as file:
    file.write(str(os.getpid()))
print("ready", flush=True)
while True:
    time.sleep(3600)
