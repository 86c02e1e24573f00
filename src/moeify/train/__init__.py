"""moeify.train"""
