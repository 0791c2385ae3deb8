"""The agent's persistence, in one place: ``store`` (the node's records in memory and on
disk, written before anything depends on them) over ``schema`` (the SQLite file)."""
