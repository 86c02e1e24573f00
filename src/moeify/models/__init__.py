"""moeify.models"""
