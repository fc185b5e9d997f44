"""fleetrl.actors.workers: environment workers on other hosts.

The daemon side is the actor ``fleetrl.actors.workers:run`` (`actor`): it owns the task
source and cursor, mounts the join endpoint (`hub`), hands tasks to workers and requeues
those of a worker that is lost (`book`, pure). The worker side is `fleetrl worker --join
URL --token T` (`cli`, `client`): it runs the environment worker's task machinery with
sandboxes on its own host's Docker engine and calls the sampler pool through its
connection. The harness travels signed (`shipping`); the tokenizer in the welcome
(`tokenizer_files`). docs/guides/remote-workers.md is the guide.
"""

from .actor import Inbox, run
from .book import Held, TaskBook
from .config import RemoteWorkersConfig
from .hub import Hub, HubStatistics

__all__ = ["Held", "Hub", "HubStatistics", "Inbox", "RemoteWorkersConfig", "TaskBook", "run"]
