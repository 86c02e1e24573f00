"""Files copied into every directory ``moeify export`` writes (transformers loads them with
trust_remote_code=True); they are not imported by moeify itself."""
