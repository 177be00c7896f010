from drafter_service.server import start
from specdec.serving.service_main import run_service

run_service("drafter", start)
