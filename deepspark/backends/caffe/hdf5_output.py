"""HDF5Output on the Caffe backend: a pycaffe Python layer that writes its two bottoms with DeepSpark's writer.

Imported by pycaffe's layer factory only (it subclasses the real caffe.Layer).
"""

import caffe

from deepspark import checkpoint


class HDF5OutputLayer(caffe.Layer):
    """Every forward: bottom 0 as dataset 'data', bottom 1 as 'label' of the file param_str names."""

    def setup(self, bottom, top):
        self.file_name = self.param_str

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        checkpoint.write_hdf5_output(self.file_name, bottom[0].data, bottom[1].data)

    def backward(self, top, propagate_down, bottom):
        pass
