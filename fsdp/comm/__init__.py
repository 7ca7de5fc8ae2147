"""Communication and cross-rank agreement.

Owns: typed asynchronous collectives (``collectives.py``), simulated steps on the meta device
(``simulation.py``), naming a rank that stopped
(``lost_ranks.py``), the handshakes by which ranks agree before a collective whose size depends on
per-rank state (``consistency.py``), who talks to whom under each sharding strategy
(``topology.py``), when all-gathers are launched (``schedule.py``), the all-reduce buckets of
replicated gradients (``buckets.py``) and the reduce-scatter buckets of small sharded gradients
(``rs_buckets.py``).

Imports from: fsdp.api, fsdp.common.
"""
