"""The base class of keras_mone's data-augmentation layers.

Keras' ``DataLayer`` (``TFDataLayer`` before Keras 3.10) runs a layer's math
with the ops of the running backend, or with TensorFlow's inside a
``tf.data`` pipeline, so one layer serves both. It is not exported under a
public name yet, hence the import from its module.
"""

try:
    from keras.src.layers.preprocessing.data_layer import DataLayer
except ImportError:  # Keras < 3.10
    from keras.src.layers.preprocessing.tf_data_layer import TFDataLayer as DataLayer

__all__ = ["DataLayer"]
