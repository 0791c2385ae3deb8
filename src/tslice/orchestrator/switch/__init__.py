"""A switch: its plan, one step per node, the link to each node's agent."""
