from art_backend.cli import app

app(prog_name="art-backend")
