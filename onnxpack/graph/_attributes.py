"""The attribute names each ONNX op allows at each version, without importing onnx.

onnxruntime (through onnx's checker) refuses at load a node of the default or ``ai.onnx.ml``
domain that carries an attribute its op's schema does not declare at the model's opset
("Unrecognized attribute"), e.g. ReduceMean's ``axes`` attribute at opset 18 and later (an input
since).  A runtime that ignores such an attribute computes something else (ReduceMean over all
axes), so :func:`allowed` gives the load the names each schema declares.

``_TABLE`` is generated from ``onnx.defs`` by :func:`generate` (``python3 -m
onnxpack.graph._attributes`` prints the table for the installed onnx, ``... --write`` puts it
here; tests/graph/test_attributes.py compares the two).  One line per op: ``op_type``
(``ai.onnx.ml/op_type`` for the ML domain), then ``since_version:name,name,...`` per version of
its schema, where ``=`` stands for the names of the version before and ``*`` for a schema that
allows any attribute (onnx's AllowUncheckedAttributes).  The lines are split on the first lookup,
an op's versions parsed on its first lookup, each (domain, op, opset) answered once.  Importing
this module (no onnx) costs ~0.8 ms compiled from source; ``generate`` imports onnx.
"""

from __future__ import annotations

__all__ = ["allowed", "generate", "DOMAINS"]

DOMAINS = ("", "ai.onnx.ml")

_TABLE = """\
Abs 1:consumed_inputs 6: 13:=
Acos 7: 22:=
Acosh 9: 22:=
Add 1:axis,broadcast,consumed_inputs 6:axis,broadcast 7: 13:= 14:=
AffineGrid 20:align_corners
And 1:axis,broadcast 7:
ArgMax 1:axis,keepdims 11:= 12:axis,keepdims,select_last_index 13:=
ArgMin 1:axis,keepdims 11:= 12:axis,keepdims,select_last_index 13:=
Asin 7: 22:=
Asinh 9: 22:=
Atan 7: 22:=
Atanh 9: 22:=
Attention 23:is_causal,kv_num_heads,q_num_heads,qk_matmul_output_mode,scale,softcap,softmax_precision 24:= 25:is_causal,kv_num_heads,left_window_size,q_num_heads,qk_matmul_output_mode,right_window_size,scale,softcap,softmax_precision
AveragePool 1:auto_pad,kernel_shape,pads,strides 7:auto_pad,count_include_pad,kernel_shape,pads,strides 10:auto_pad,ceil_mode,count_include_pad,kernel_shape,pads,strides 11:= 19:auto_pad,ceil_mode,count_include_pad,dilations,kernel_shape,pads,strides 22:=
BatchNormalization 1:consumed_inputs,epsilon,is_test,momentum,spatial 6:epsilon,is_test,momentum,spatial 7:epsilon,momentum,spatial 9:epsilon,momentum 14:epsilon,momentum,training_mode 15:=
Bernoulli 15:dtype,seed 22:=
BitCast 26:to
BitShift 11:direction 28:=
BitwiseAnd 18:
BitwiseNot 18:
BitwiseOr 18:
BitwiseXor 18:
BlackmanWindow 17:output_datatype,periodic
Cast 1:to 6:= 9:= 13:= 19:saturate,to 21:= 23:= 24:round_mode,saturate,to 25:= 28:=
CastLike 15: 19:saturate 21:= 23:= 24:round_mode,saturate 25:=
CausalConvWithState 27:activation
Ceil 1:consumed_inputs 6: 13:=
Celu 12:alpha 28:=
CenterCropPad 18:axes
Clip 1:consumed_inputs,max,min 6:max,min 11: 12:= 13:=
Col2Im 18:dilations,pads,strides
Compress 9:axis 11:= 28:=
Concat 1:axis 4:= 11:= 13:=
ConcatFromSequence 11:axis,new_axis
Constant 1:value 9:= 11:sparse_value,value 12:sparse_value,value,value_float,value_floats,value_int,value_ints,value_string,value_strings 13:= 19:= 21:= 23:= 24:= 25:=
ConstantOfShape 9:value 20:= 21:= 23:= 24:= 25:=
Conv 1:auto_pad,dilations,group,kernel_shape,pads,strides 11:= 22:=
ConvInteger 10:auto_pad,dilations,group,kernel_shape,pads,strides
ConvTranspose 1:auto_pad,dilations,group,kernel_shape,output_padding,output_shape,pads,strides 11:= 22:=
Cos 7: 22:=
Cosh 9: 22:=
CumProd 26:exclusive,reverse
CumSum 11:exclusive,reverse 14:=
DFT 17:axis,inverse,onesided 20:inverse,onesided
DeformConv 19:dilations,group,kernel_shape,offset_group,pads,strides 22:=
DepthToSpace 1:blocksize 11:blocksize,mode 13:= 28:=
DequantizeLinear 10: 13:axis 19:= 21:axis,block_size 23:axis,block_size,output_dtype 24:= 25:= 28:=
Det 11: 22:=
Div 1:axis,broadcast,consumed_inputs 6:axis,broadcast 7: 13:= 14:=
Dropout 1:consumed_inputs,is_test,ratio 6:is_test,ratio 7:ratio 10:= 12:seed 13:= 22:=
DynamicQuantizeLinear 11:
Einsum 12:equation 28:=
Elu 1:alpha,consumed_inputs 6:alpha 22:=
Equal 1:axis,broadcast 7: 11:= 13:= 19:=
Erf 9: 13:=
Exp 1:consumed_inputs 6: 13:=
Expand 8: 13:=
EyeLike 9:dtype,k 22:=
Flatten 1:axis 9:= 11:= 13:= 21:= 23:= 24:= 25:=
Floor 1:consumed_inputs 6: 13:=
GRU 1:activation_alpha,activation_beta,activations,clip,direction,hidden_size,output_sequence 3:activation_alpha,activation_beta,activations,clip,direction,hidden_size,linear_before_reset,output_sequence 7:activation_alpha,activation_beta,activations,clip,direction,hidden_size,linear_before_reset 14:activation_alpha,activation_beta,activations,clip,direction,hidden_size,layout,linear_before_reset 22:=
Gather 1:axis 11:= 13:=
GatherElements 11:axis 13:=
GatherND 11: 12:batch_dims 13:=
Gelu 20:approximate
Gemm 1:alpha,beta,broadcast,transA,transB 6:= 7:alpha,beta,transA,transB 9:= 11:= 13:=
GlobalAveragePool 1: 22:=
GlobalLpPool 1:p 2:= 22:=
GlobalMaxPool 1: 22:=
Greater 1:axis,broadcast 7: 9:= 13:=
GreaterOrEqual 12: 16:=
GridSample 16:align_corners,mode,padding_mode 20:= 22:=
GroupNormalization 18:epsilon,num_groups 21:epsilon,num_groups,stash_type
HammingWindow 17:output_datatype,periodic
HannWindow 17:output_datatype,periodic
HardSigmoid 1:alpha,beta,consumed_inputs 6:alpha,beta 22:=
HardSwish 14: 22:=
Hardmax 1:axis 11:= 13:=
Identity 1: 13:= 14:= 16:= 19:= 21:= 23:= 24:= 25:=
If 1:else_branch,then_branch 11:= 13:= 16:= 19:= 21:= 23:= 24:= 25:=
ImageDecoder 20:pixel_format
InstanceNormalization 1:consumed_inputs,epsilon 6:epsilon 22:=
IsInf 10:detect_negative,detect_positive 20:=
IsNaN 9: 13:= 20:=
LRN 1:alpha,beta,bias,size 13:=
LSTM 1:activation_alpha,activation_beta,activations,clip,direction,hidden_size,input_forget,output_sequence 7:activation_alpha,activation_beta,activations,clip,direction,hidden_size,input_forget 14:activation_alpha,activation_beta,activations,clip,direction,hidden_size,input_forget,layout 22:=
LayerNormalization 17:*
LeakyRelu 1:alpha,consumed_inputs 6:alpha 16:=
Less 1:axis,broadcast 7: 9:= 13:=
LessOrEqual 12: 16:=
LinearAttention 27:chunk_size,kv_num_heads,q_num_heads,scale,update_rule
Log 1:consumed_inputs 6: 13:=
LogSoftmax 1:axis 11:= 13:=
Loop 1:body 11:= 13:= 16:= 19:= 21:= 23:= 24:= 25:=
LpNormalization 1:axis,p 22:=
LpPool 1:auto_pad,kernel_shape,p,pads,strides 2:= 11:= 18:auto_pad,ceil_mode,dilations,kernel_shape,p,pads,strides 22:=
MatMul 1: 9:= 13:=
MatMulInteger 10:
Max 1:consumed_inputs 6: 8:= 12:= 13:=
MaxPool 1:auto_pad,kernel_shape,pads,strides 8:auto_pad,kernel_shape,pads,storage_order,strides 10:auto_pad,ceil_mode,dilations,kernel_shape,pads,storage_order,strides 11:= 12:= 22:=
MaxRoiPool 1:pooled_shape,spatial_scale 22:=
MaxUnpool 9:kernel_shape,pads,strides 11:= 22:=
Mean 1:consumed_inputs 6: 8:= 13:=
MeanVarianceNormalization 9:axes 13:=
MelWeightMatrix 17:output_datatype
Min 1:consumed_inputs 6: 8:= 12:= 13:=
Mish 18: 22:=
Mod 10:fmod 13:= 28:=
Mul 1:axis,broadcast,consumed_inputs 6:axis,broadcast 7: 13:= 14:=
Multinomial 7:dtype,sample_size,seed 22:=
Neg 1:consumed_inputs 6: 13:=
NegativeLogLikelihoodLoss 12:ignore_index,reduction 13:= 22:=
NonMaxSuppression 10:center_point_box 11:=
NonZero 9: 13:=
Not 1:
OneHot 9:axis 11:= 28:=
Optional 15:type 28:=
OptionalGetElement 15: 18:= 28:=
OptionalHasElement 15: 18:= 28:=
Or 1:axis,broadcast 7:
PRelu 1:consumed_inputs 6: 7:= 9:= 16:=
Pad 1:mode,paddings,value 2:mode,pads,value 11:mode 13:= 18:= 19:= 21:= 23:= 24:= 25:=
Pow 1:axis,broadcast 7: 12:= 13:= 15:=
QLinearConv 10:auto_pad,dilations,group,kernel_shape,pads,strides
QLinearMatMul 10: 21:=
QuantizeLinear 10: 13:axis 19:axis,saturate 21:axis,block_size,output_dtype,saturate 23:axis,block_size,output_dtype,precision,saturate 24:= 25:= 28:=
RMSNormalization 23:axis,epsilon,stash_type
RNN 1:activation_alpha,activation_beta,activations,clip,direction,hidden_size,output_sequence 7:activation_alpha,activation_beta,activations,clip,direction,hidden_size 14:activation_alpha,activation_beta,activations,clip,direction,hidden_size,layout 22:=
RandomNormal 1:dtype,mean,scale,seed,shape 22:=
RandomNormalLike 1:dtype,mean,scale,seed 22:=
RandomUniform 1:dtype,high,low,seed,shape 22:=
RandomUniformLike 1:dtype,high,low,seed 22:=
Range 11: 27:stash_type
Reciprocal 1:consumed_inputs 6: 13:=
ReduceL1 1:axes,keepdims 11:= 13:= 18:keepdims,noop_with_empty_axes
ReduceL2 1:axes,keepdims 11:= 13:= 18:keepdims,noop_with_empty_axes
ReduceLogSum 1:axes,keepdims 11:= 13:= 18:keepdims,noop_with_empty_axes 28:=
ReduceLogSumExp 1:axes,keepdims 11:= 13:= 18:keepdims,noop_with_empty_axes 28:=
ReduceMax 1:axes,keepdims 11:= 12:= 13:= 18:keepdims,noop_with_empty_axes 20:=
ReduceMean 1:axes,keepdims 11:= 13:= 18:keepdims,noop_with_empty_axes
ReduceMin 1:axes,keepdims 11:= 12:= 13:= 18:keepdims,noop_with_empty_axes 20:=
ReduceProd 1:axes,keepdims 11:= 13:= 18:keepdims,noop_with_empty_axes
ReduceSum 1:axes,keepdims 11:= 13:keepdims,noop_with_empty_axes
ReduceSumSquare 1:axes,keepdims 11:= 13:= 18:keepdims,noop_with_empty_axes
RegexFullMatch 20:pattern
Relu 1:consumed_inputs 6: 13:= 14:=
Reshape 1:consumed_inputs,shape 5: 13:= 14:allowzero 19:= 21:= 23:= 24:= 25:=
Resize 10:mode 11:coordinate_transformation_mode,cubic_coeff_a,exclude_outside,extrapolation_value,mode,nearest_mode 13:= 18:antialias,axes,coordinate_transformation_mode,cubic_coeff_a,exclude_outside,extrapolation_value,keep_aspect_ratio_policy,mode,nearest_mode 19:=
ReverseSequence 10:batch_axis,time_axis 28:=
RoiAlign 10:mode,output_height,output_width,sampling_ratio,spatial_scale 16:coordinate_transformation_mode,mode,output_height,output_width,sampling_ratio,spatial_scale 22:=
RotaryEmbedding 23:interleaved,num_heads,rotary_embedding_dim
Round 11: 22:=
STFT 17:onesided
Scan 8:body,directions,num_scan_inputs 9:body,num_scan_inputs,scan_input_axes,scan_input_directions,scan_output_axes,scan_output_directions 11:= 16:= 19:= 21:= 23:= 24:= 25:=
Scatter 9:axis 11:=
ScatterElements 11:axis 13:= 16:axis,reduction 18:=
ScatterND 11: 13:= 16:reduction 18:=
Selu 1:alpha,consumed_inputs,gamma 6:alpha,gamma 22:=
SequenceAt 11:
SequenceConstruct 11:
SequenceEmpty 11:dtype
SequenceErase 11:
SequenceInsert 11:
SequenceLength 11:
SequenceMap 17:body
Shape 1: 13:= 15:end,start 19:= 21:= 23:= 24:= 25:=
Shrink 9:bias,lambd
Sigmoid 1:consumed_inputs 6: 13:=
Sign 9: 13:=
Sin 7: 22:=
Sinh 9: 22:=
Size 1: 13:= 19:= 21:= 23:= 24:= 25:=
Slice 1:axes,ends,starts 10: 11:= 13:=
Softmax 1:axis 11:= 13:=
SoftmaxCrossEntropyLoss 12:ignore_index,reduction 13:=
Softplus 1: 22:=
Softsign 1: 22:=
SpaceToDepth 1:blocksize 13:= 28:blocksize,mode
Split 1:axis,split 2:= 11:= 13:axis 18:axis,num_outputs
SplitToSequence 11:axis,keepdims 24:=
Sqrt 1:consumed_inputs 6: 13:=
Squeeze 1:axes 11:= 13: 21:= 23:= 24:= 25:=
StringConcat 20:
StringNormalizer 10:case_change_action,is_case_sensitive,locale,stopwords
StringSplit 20:delimiter,maxsplit
Sub 1:axis,broadcast,consumed_inputs 6:axis,broadcast 7: 13:= 14:=
Sum 1:consumed_inputs 6: 8:= 13:=
SwiGLU 28:alpha
Swish 24:alpha
Tan 7: 22:=
Tanh 1:consumed_inputs 6: 13:=
TensorScatter 24:axis,mode
TfIdfVectorizer 9:max_gram_length,max_skip_count,min_gram_length,mode,ngram_counts,ngram_indexes,pool_int64s,pool_strings,weights
ThresholdedRelu 10:alpha 22:=
Tile 1: 6:= 13:=
TopK 1:axis,k 10:axis 11:axis,largest,sorted 24:=
Transpose 1:perm 13:= 21:= 23:= 24:= 25:=
Trilu 14:upper
Unique 11:axis,sorted 28:=
Unsqueeze 1:axes 11:= 13: 21:= 23:= 24:= 25:=
Upsample 1:height_scale,mode,width_scale 7:mode,scales 9:mode 10:=
Where 9: 16:=
Xor 1:axis,broadcast 7:
ai.onnx.ml/ArrayFeatureExtractor 1:
ai.onnx.ml/Binarizer 1:threshold
ai.onnx.ml/CastMap 1:cast_to,map_form,max_map
ai.onnx.ml/CategoryMapper 1:cats_int64s,cats_strings,default_int64,default_string
ai.onnx.ml/DictVectorizer 1:int64_vocabulary,string_vocabulary
ai.onnx.ml/FeatureVectorizer 1:inputdimensions
ai.onnx.ml/Imputer 1:imputed_value_floats,imputed_value_int64s,replaced_value_float,replaced_value_int64
ai.onnx.ml/LabelEncoder 1:classes_strings,default_int64,default_string 2:default_float,default_int64,default_string,keys_floats,keys_int64s,keys_strings,values_floats,values_int64s,values_strings 4:default_float,default_int64,default_string,default_tensor,keys_floats,keys_int64s,keys_strings,keys_tensor,values_floats,values_int64s,values_strings,values_tensor
ai.onnx.ml/LinearClassifier 1:classlabels_ints,classlabels_strings,coefficients,intercepts,multi_class,post_transform
ai.onnx.ml/LinearRegressor 1:coefficients,intercepts,post_transform,targets
ai.onnx.ml/Normalizer 1:norm
ai.onnx.ml/OneHotEncoder 1:cats_int64s,cats_strings,zeros
ai.onnx.ml/SVMClassifier 1:classlabels_ints,classlabels_strings,coefficients,kernel_params,kernel_type,post_transform,prob_a,prob_b,rho,support_vectors,vectors_per_class
ai.onnx.ml/SVMRegressor 1:coefficients,kernel_params,kernel_type,n_supports,one_class,post_transform,rho,support_vectors
ai.onnx.ml/Scaler 1:offset,scale
ai.onnx.ml/TreeEnsemble 5:aggregate_function,leaf_targetids,leaf_weights,membership_values,n_targets,nodes_falseleafs,nodes_falsenodeids,nodes_featureids,nodes_hitrates,nodes_missing_value_tracks_true,nodes_modes,nodes_splits,nodes_trueleafs,nodes_truenodeids,post_transform,tree_roots
ai.onnx.ml/TreeEnsembleClassifier 1:base_values,class_ids,class_nodeids,class_treeids,class_weights,classlabels_int64s,classlabels_strings,nodes_falsenodeids,nodes_featureids,nodes_hitrates,nodes_missing_value_tracks_true,nodes_modes,nodes_nodeids,nodes_treeids,nodes_truenodeids,nodes_values,post_transform 3:base_values,base_values_as_tensor,class_ids,class_nodeids,class_treeids,class_weights,class_weights_as_tensor,classlabels_int64s,classlabels_strings,nodes_falsenodeids,nodes_featureids,nodes_hitrates,nodes_hitrates_as_tensor,nodes_missing_value_tracks_true,nodes_modes,nodes_nodeids,nodes_treeids,nodes_truenodeids,nodes_values,nodes_values_as_tensor,post_transform 5:=
ai.onnx.ml/TreeEnsembleRegressor 1:aggregate_function,base_values,n_targets,nodes_falsenodeids,nodes_featureids,nodes_hitrates,nodes_missing_value_tracks_true,nodes_modes,nodes_nodeids,nodes_treeids,nodes_truenodeids,nodes_values,post_transform,target_ids,target_nodeids,target_treeids,target_weights 3:aggregate_function,base_values,base_values_as_tensor,n_targets,nodes_falsenodeids,nodes_featureids,nodes_hitrates,nodes_hitrates_as_tensor,nodes_missing_value_tracks_true,nodes_modes,nodes_nodeids,nodes_treeids,nodes_truenodeids,nodes_values,nodes_values_as_tensor,post_transform,target_ids,target_nodeids,target_treeids,target_weights,target_weights_as_tensor 5:=
ai.onnx.ml/ZipMap 1:classlabels_int64s,classlabels_strings
"""

_lines: dict[str, str] | None = None
_versions: dict[str, tuple[tuple[int, frozenset[str] | None], ...]] = {}
_cache: dict[tuple[str, str, int], frozenset[str] | None] = {}


def _parse(key: str) -> tuple[tuple[int, frozenset[str] | None], ...]:
    global _lines
    if _lines is None:
        _lines = dict(line.split(" ", 1) for line in _TABLE.splitlines())
    line = _lines.get(key)
    out: list[tuple[int, frozenset[str] | None]] = []
    if line is not None:
        names: frozenset[str] | None = frozenset()
        for item in line.split(" "):
            since, _, text = item.partition(":")
            if text == "*":
                names = None
            elif text != "=":
                names = frozenset(text.split(",")) if text else frozenset()
            out.append((int(since), names))
    versions = _versions[key] = tuple(out)
    return versions


def allowed(domain: str, op_type: str, opset: int) -> frozenset[str] | None:
    """The attribute names ``op_type`` of ``domain`` (``""``, ``"ai.onnx"`` or ``"ai.onnx.ml"``)
    declares at ``opset`` (the model's version of that domain), or ``None`` when there is nothing
    to check against: an op or domain the table does not know, an opset before the op's first
    version, a schema that allows any attribute."""
    key = (domain, op_type, opset)
    try:
        return _cache[key]
    except KeyError:
        pass
    if domain in ("", "ai.onnx"):
        name = op_type
    elif domain == "ai.onnx.ml":
        name = "ai.onnx.ml/" + op_type
    else:
        _cache[key] = None
        return None
    versions = _versions.get(name)
    if versions is None:
        versions = _parse(name)
    result = None
    for since, names in versions:  # ascending
        if since > opset:
            break
        result = names
    _cache[key] = result
    return result


def generate() -> str:
    """The table for the installed onnx (imports onnx: for tests and regeneration only)."""
    import onnx
    import onnx.checker
    import onnx.defs

    by_op: dict[str, list[tuple[int, str]]] = {}
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain not in DOMAINS:
            continue
        names = ",".join(sorted(schema.attributes))
        if _allows_unchecked(onnx, schema):
            names = "*"
        key = schema.name if schema.domain == "" else f"{schema.domain}/{schema.name}"
        by_op.setdefault(key, []).append((schema.since_version, names))
    lines = []
    for key in sorted(by_op):
        items, previous = [], None
        for since, names in sorted(by_op[key]):
            items.append(f"{since}:{'=' if names == previous else names}")
            previous = names
        lines.append(f"{key} {' '.join(items)}")
    return "".join(line + "\n" for line in lines)


def _allows_unchecked(onnx, schema) -> bool:
    """Whether onnx's checker lets a node of this schema carry an undeclared attribute (the
    Python binding does not expose AllowUncheckedAttributes: asked of the checker itself)."""
    node = onnx.helper.make_node(schema.name, ["x"] * schema.min_input, ["y"] * max(1, schema.min_output),
                                 domain=schema.domain, zz_undeclared_attribute=1)
    ctx = type(onnx.checker.DEFAULT_CONTEXT)()
    ctx.ir_version = onnx.IR_VERSION
    ctx.opset_imports = {schema.domain: schema.since_version}
    try:
        onnx.checker.check_node(node, ctx)
    except onnx.checker.ValidationError:  # the attribute, or a deprecated op: checked
        return False
    return True


def _write() -> None:
    """Rewrites ``_TABLE`` in this file with :func:`generate`'s table."""
    with open(__file__, encoding="utf-8") as f:
        text = f.read()
    start = text.index('_TABLE = """\\\n') + len('_TABLE = """\\\n')
    end = text.index('"""', start)
    from onnxpack._io import atomic_write

    data = (text[:start] + generate() + text[end:]).encode("utf-8")
    atomic_write(__file__, lambda f: f.write(data))


if __name__ == "__main__":  # python3 -m onnxpack.graph._attributes [--write]
    import sys

    if sys.argv[1:] == ["--write"]:
        _write()
    else:
        print(generate(), end="")
