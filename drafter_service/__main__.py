from specdec.service_main import run_service
from drafter_service.server import start

run_service("drafter", start)
