"""What the job side shares with the servers: ids, errors, input validation, residency
states and task supervision. Anything only servers use lives in ``tslice.server``,
``tslice.rpc`` or ``tslice.security``."""
