"""Training backends. Only ``registry`` names them; nothing else imports one directly."""
