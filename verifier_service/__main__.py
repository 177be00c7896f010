from specdec.serving.service_main import run_service
from verifier_service.server import start

run_service("verifier", start)
