"""The agent's run, decided: its step, the restart policy, the stop plan, failures and what the
agent tells of them."""
