"""Foundation helpers below the store: structured logging and safe terminal text."""
