import os
import sys

# workers.py must import by name here and in the spawned ranks (spawn copies sys.path).
sys.path.insert(0, os.path.dirname(__file__))
