"""What the job side shares with the servers: errors, input validation (ids included),
residency states and task supervision. Anything only servers use lives in ``tslice.server``,
``tslice.rpc`` or ``tslice.security``."""
