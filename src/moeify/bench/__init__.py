"""moeify.bench"""
