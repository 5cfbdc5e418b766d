"""Names of the environment variables a PS job's processes read (kept free of heavy imports for the CLI); their
numeric values are read with :func:`gradsync.env.env_number`."""

__all__ = ["SERVERS_ENV", "CLIENTS_ENV", "TIMEOUT_ENV", "SECRET_ENV", "JOB_ENV", "INSECURE_ENV", "MAX_AHEAD_ENV",
           "MAX_PARKED_ENV", "MAX_PARKED_PER_CLIENT_ENV", "ELASTIC_TIMEOUT_ENV", "MAX_KEYS_ENV", "MAX_BYTES_ENV"]

#: comma-separated ZeroMQ endpoints of the servers, in server order
SERVERS_ENV = "GRADSYNC_PS_SERVERS"
#: number of clients (worker groups) that talk to the servers
CLIENTS_ENV = "GRADSYNC_PS_CLIENTS"
#: seconds one KVStore request may take before it fails
TIMEOUT_ENV = "GRADSYNC_PS_TIMEOUT"
#: shared secret authenticating every frame (AES-GMAC or HMAC-SHA256: `wire`); never on a command line. `gradsync launch` makes
#: a random one per job unless it is set
SECRET_ENV = "GRADSYNC_PS_SECRET"
#: the job's id (hex, or any text: hashed): a server serves one job and refuses requests from another.
#: `gradsync launch` makes a random one; else workers derive it from torchrun's MASTER_ADDR/MASTER_PORT
JOB_ENV = "GRADSYNC_PS_JOB"
#: "1": a server without a secret may bind to a non-loopback address (anyone who reaches it can use it)
INSECURE_ENV = "GRADSYNC_PS_INSECURE"
#: rounds ahead of a key's current round a server buffers pushes (and parks pulls) for (default 8)
MAX_AHEAD_ENV = "GRADSYNC_PS_MAX_AHEAD"
#: pulls (and barrier waits) a server parks per key (default 1024)
MAX_PARKED_ENV = "GRADSYNC_PS_MAX_PARKED"
#: pulls, barrier waits and held ordered replies a server parks per client connection (default 16384)
MAX_PARKED_PER_CLIENT_ENV = "GRADSYNC_PS_MAX_PARKED_PER_CLIENT"
#: seconds without a frame from a client (its heartbeat included) after which a server drops it from the
#: rounds of elastic keys (kvstore.create(..., elastic=True)); read by servers and workers (default 10)
ELASTIC_TIMEOUT_ENV = "GRADSYNC_PS_ELASTIC_TIMEOUT"
#: key slices one server stores at most (default 1048576)
MAX_KEYS_ENV = "GRADSYNC_PS_MAX_KEYS"
#: bytes of stored values one server holds at most (default: half of this machine's memory)
MAX_BYTES_ENV = "GRADSYNC_PS_MAX_BYTES"

