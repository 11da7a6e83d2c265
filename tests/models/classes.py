"""Models beyond causal LMs, as their libraries build them (transformers and diffusers from a
config, nothing downloaded; plain torch.nn), for `pyplan partition`: a factory, a batch and a
loss per class (issue #59). Tiny configurations: each has at least 4 units to cut between.

`NAMES` lists them; `classes:NAME` is the factory, `classes:NAME_batch` the batch and
`classes:NAME_loss` the loss (`classes:loss` and `classes:batch` where they are shared)."""

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 8
NAMES = ("resnet", "mobilenet_v2", "convnext", "vit", "swin", "bert", "t5", "bart", "whisper",
         "clip", "unet", "recommender", "sequential_cnn")


def _quiet():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


# -- CNNs with batch normalisation, ConvNeXt, vision transformers: images -> 4 classes --------

def images(step: int, size: int = 16, classes: int = 4):
    return torch.randn(BATCH, 3, size, size), torch.randint(0, classes, (BATCH,))


def classify(output, labels):
    """Cross-entropy of a classifier's logits (the `.logits` of its ModelOutput)."""
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits, labels)


def resnet():
    t = _quiet()
    return t.ResNetForImageClassification(t.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 16], depths=[1, 1, 1], num_labels=4))


def mobilenet_v2():
    t = _quiet()
    return t.MobileNetV2ForImageClassification(t.MobileNetV2Config(
        image_size=16, depth_multiplier=0.25, num_labels=4, tf_padding=True,
        finegrained_output=False))


def convnext():
    t = _quiet()
    return t.ConvNextForImageClassification(t.ConvNextConfig(
        num_stages=2, hidden_sizes=[8, 16], depths=[1, 2], num_labels=4, image_size=16))


def vit():
    t = _quiet()
    return t.ViTForImageClassification(t.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=64, num_labels=4))


def swin():
    t = _quiet()
    return t.SwinForImageClassification(t.SwinConfig(
        image_size=16, patch_size=2, embed_dim=8, depths=[2, 2], num_heads=[1, 2],
        window_size=2, num_labels=4))


def sequential_cnn():
    """A batch-norm CNN as an nn.Sequential (cut as a chain of its children)."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


resnet_batch = mobilenet_v2_batch = convnext_batch = vit_batch = swin_batch = images
sequential_cnn_batch = images
resnet_loss = mobilenet_v2_loss = convnext_loss = vit_loss = swin_loss = classify
sequential_cnn_loss = classify


# -- an encoder with an attention mask and a classification head ---------------------------

VOCAB, SEQUENCE = 64, 12


def _mask(size: int, length: int):
    """Attention masks with padding: sequence i keeps its first length - i % 4 tokens."""
    kept = length - torch.arange(size) % 4
    return (torch.arange(length)[None, :] < kept[:, None]).long()


def bert():
    t = _quiet()
    return t.BertForSequenceClassification(t.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=3))


def bert_batch(step: int):
    ids = torch.randint(3, VOCAB, (BATCH, SEQUENCE))
    return {"input_ids": ids, "attention_mask": _mask(BATCH, SEQUENCE)}, \
        torch.randint(0, 3, (BATCH,))


bert_loss = classify


# -- encoder-decoders: inputs as a dict of keyword arguments --------------------------------

def t5():
    t = _quiet()
    return t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=2, decoder_start_token_id=0, pad_token_id=0))


def bart():
    t = _quiet()
    return t.BartForConditionalGeneration(t.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=2))


def seq2seq_batch(step: int):
    """Source ids with a padding mask, the decoder's input ids (the targets shifted right)."""
    source = torch.randint(3, VOCAB, (BATCH, SEQUENCE))
    target = torch.randint(3, VOCAB, (BATCH, SEQUENCE // 2 + 1))
    return {"input_ids": source, "attention_mask": _mask(BATCH, SEQUENCE),
            "decoder_input_ids": target[:, :-1]}, target[:, 1:]


def seq2seq_loss(output, labels):
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def whisper():
    t = _quiet()
    return t.WhisperForConditionalGeneration(t.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1))


def whisper_batch(step: int):
    """Log-mel features (8 bins, 16 frames: twice the encoder's positions) and decoder ids."""
    target = torch.randint(3, VOCAB, (BATCH, 7))
    return {"input_features": torch.randn(BATCH, 8, 16), "decoder_input_ids": target[:, :-1]}, \
        target[:, 1:]


t5_batch = bart_batch = seq2seq_batch
t5_loss = bart_loss = whisper_loss = seq2seq_loss


# -- two towers: a text and an image encoder joined by a contrastive loss -----------------

def clip():
    t = _quiet()
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=16)
    vision = dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2)
    return t.CLIPModel(t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


def clip_batch(step: int):
    return {"input_ids": torch.randint(3, VOCAB, (BATCH, 8)),
            "pixel_values": torch.randn(BATCH, 3, 16, 16)}, torch.arange(BATCH) % (BATCH // 2)


def clip_loss(output, pairs):
    """The symmetric contrastive loss over the micro-batch's pairs (CLIPOutput's logits: image i
    against text j of the micro-batch); `pairs` only sizes it (its own index matches). Over
    the micro-batch as a whole, not a mean over its samples: it says so (`per_micro_batch`),
    and --check's reference averages the micro-batches' losses as the pipeline does."""
    image = output.logits_per_image
    labels = torch.arange(image.shape[0])
    return (F.cross_entropy(image, labels) + F.cross_entropy(output.logits_per_text, labels)) / 2


clip_loss.per_micro_batch = True  # (not a mean over samples: --check averages micro-batches')


# -- a diffusion U-Net: noisy images and timesteps in, the noise out ------------------------

def unet():
    from diffusers import UNet2DModel

    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(8, 16), norm_num_groups=4,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=8)


def unet_batch(step: int):
    """(noisy images, timesteps) as positional arguments, the noise as the target."""
    noise = torch.randn(BATCH, 3, 8, 8)
    return (torch.randn(BATCH, 3, 8, 8) + noise, torch.randint(0, 1000, (BATCH,))), noise


def unet_loss(output, noise):
    return F.mse_loss(output.sample, noise)


# -- a recommender: embedding-bag tables, a dense MLP, their interaction, a top MLP ----------

TABLES, ROWS, WIDTH, DENSE, BAG = 3, 20, 8, 5, 2


class Recommender(nn.Module):
    """DLRM's shape: dense features through a bottom MLP, one EmbeddingBag per sparse feature
    (a bag of rows per example), their pairwise dot products, then a top MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(DENSE, 16), nn.ReLU(), nn.Linear(16, WIDTH),
                                    nn.ReLU())
        self.tables = nn.ModuleList(nn.EmbeddingBag(ROWS, WIDTH, mode="sum")
                                    for _ in range(TABLES))
        pairs = (TABLES + 1) * TABLES // 2
        self.top = nn.Sequential(nn.Linear(WIDTH + pairs, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense, sparse):
        features = [self.bottom(dense)] + [table(sparse[:, k]) for k, table in
                                           enumerate(self.tables)]
        stacked = torch.stack(features, dim=1)
        dots = stacked @ stacked.transpose(1, 2)
        upper = torch.triu_indices(TABLES + 1, TABLES + 1, offset=1)
        return self.top(torch.cat([features[0], dots[:, upper[0], upper[1]]], dim=1))


def recommender():
    return Recommender()


def recommender_batch(step: int):
    """(dense features, sparse features: per example and table a bag of BAG row indices) as
    positional arguments, and the clicks."""
    return (torch.randn(BATCH, DENSE), torch.randint(0, ROWS, (BATCH, TABLES, BAG))), \
        torch.randint(0, 2, (BATCH, 1)).float()


def recommender_loss(output, clicks):
    return F.binary_cross_entropy_with_logits(output, clicks)
