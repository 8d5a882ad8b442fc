"""What the tests share (``from support.helpers import ...``), and what the benchmarks borrow
from them: small models and repos (``helpers``), live hub servers and the LFS client steps
(``live``), their ports (``ports``), a real SeaweedFS (``seaweed``), PostgreSQL and nginx
(``system``), the Docker images' stand-ins (``containers``, ``images/``). The fixtures stay in
``tests/conftest.py``."""
