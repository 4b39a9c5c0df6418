"""Rendezvous, decided: rounds, membership changes, node order, store roles and --rdzv-conf."""
