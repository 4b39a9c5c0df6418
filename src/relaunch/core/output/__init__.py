"""What the job tells people, decided: the console's layout, status lines, metrics and events."""
