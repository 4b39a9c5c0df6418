from relaunch.cli import console_main

console_main()
