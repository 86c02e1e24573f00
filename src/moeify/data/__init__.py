"""moeify.data"""
