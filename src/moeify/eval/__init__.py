"""moeify.eval"""
