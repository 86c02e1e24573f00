"""moeify.analysis"""
