"""A module that starts a thread when imported (a fork server must refuse it)."""

import threading
import time

threading.Thread(target=time.sleep, args=(60,), name="started-at-import", daemon=True).start()
